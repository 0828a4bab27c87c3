// Validates Gateway API HTTPRoutes (gateway.networking.k8s.io/v1) with @kubernetes-models/gateway-api's validator
// (generated from the Gateway API's Go types; the release is named in stoker/kubernetes/validate.py).
// stdin: a JSON array of objects. stdout: a JSON array, per object the list of its errors ("PATH: KEYWORD PARAMS"),
// empty when valid. One process for all of a render's routes: node's start-up costs more than the checks.
// Unknown fields pass here (the schema allows them); stoker's own field list refuses them before this runs.
import { validate } from "@kubernetes-models/gateway-api/_schemas/IoK8sSigsGatewayApiApisV1HTTPRoute";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const objects = JSON.parse(Buffer.concat(chunks).toString("utf8"));
if (!Array.isArray(objects)) throw new TypeError("stdin: expected a JSON array of objects");
const errors = objects.map((obj) =>
  validate(obj) ? [] : validate.errors.map((e) => `${e.instancePath || "/"}: ${e.keyword} ${JSON.stringify(e.params)}`));
process.stdout.write(JSON.stringify(errors) + "\n");
