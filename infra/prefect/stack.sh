#!/usr/bin/env bash
# The self-hosted Prefect stack on this host, with no image registry: Debian's PostgreSQL 15 (installed with
# apt when missing), `prefect server start` on it with API basic auth, a process worker for CPU work (pool
# stoker-cpu), and a prefect-docker worker (pool stoker-gpu) that runs routed heavy steps as containers of
# stoker/worker (built here, no registry; on this GPU-less host they run on the CPU).
# The deployed flows' sources too: the local Hub mirror (olah, the tiny Llama published) and S3 (moto) on the
# demo's ports, dockerd and the Triton + proxy images (the same ones `make demo` uses, shared with it), and the
# S3 keys as the Prefect AwsCredentials block stoker-local-s3 that prefect.yaml's watcher and the example specs name.
# Then `stoker deploy-flows`: the pools, limits and automations of deployments/platform.yaml, and prefect.yaml's
# deployments through `prefect deploy --all`. Everything listens on 127.0.0.1.
#   infra/prefect/stack.sh            start (or reuse) it all; prints the env a client needs
#   infra/prefect/stack.sh down       stop the Prefect server, PostgreSQL and the workers (the Hub mirror, S3 and
#                                     dockerd are the demo's: `stoker down` stops them)
# State (DB cluster, credentials 0600, logs): $STOKER_HOME/prefect-stack. UI: add STOKER_PREFECT_UI=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
STATE=${STOKER_HOME:-$HOME/.stoker}/prefect-stack
PORT=${STOKER_PREFECT_PORT:-4200}

if [[ "${1:-up}" == down ]]; then
  exec "$PY" -c "from stoker.stack.services import stop_all; print('stopped:', stop_all('$STATE') or 'nothing')"
fi

if [[ ! -x /usr/lib/postgresql/15/bin/initdb ]]; then
  echo "installing Debian's PostgreSQL 15" >&2
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q postgresql-15
fi

"$PY" - "$STATE" "$PORT" <<'PYEOF'
import sys
from pathlib import Path
from stoker.stack.prefect_stack import ensure_postgres, ensure_server, ensure_worker
import os

state, port = Path(sys.argv[1]), int(sys.argv[2])
from stoker.demo import start_stack
hub, s3_url = start_stack(log=print)  # the Hub mirror, S3, dockerd and images the deployed flows need
db = ensure_postgres(state)
api = ensure_server(state, port=port, database_url=db, ui=os.environ.get("STOKER_PREFECT_UI") == "1")
ensure_worker(state, api, "stoker-cpu", cwd=Path.cwd())
from stoker.stack.worker_image import ensure_worker_image
ensure_worker_image(log=print)
ensure_worker(state, api, "stoker-gpu", cwd=Path.cwd(), type_="docker")
venv_bin = Path(sys.executable).parent.resolve()
(state / "client.env").write_text(f"export PREFECT_API_URL={api.url}\nexport PREFECT_API_AUTH_STRING='{api.auth}'\n"
                                  f"export PATH={venv_bin}:$PATH\n")  # prefect and stoker, as the README calls them
(state / "client.env").chmod(0o600)
print(f"Prefect API {api.url} (PostgreSQL), process worker on pool stoker-cpu, docker worker on pool stoker-gpu")
print(f"Hub mirror {hub}, S3 {s3_url}")
print(f"client settings: source {state / 'client.env'}")
PYEOF
set -a; source "$STATE/client.env"; set +a
# S3 keys for the workers, the Prefect way: a prefect-aws AwsCredentials block for the demo's local S3 server
# (`make demo`, port $STOKER_DEMO_S3_PORT); specs name it as storage.credentials_block: stoker-local-s3.
S3_URL=http://127.0.0.1:${STOKER_DEMO_S3_PORT:-19000}  # started above (stoker.demo.start_stack)
"$PY" -c "from stoker.stack.s3server import save_local_block; save_local_block('$S3_URL')"
echo "Prefect AwsCredentials block stoker-local-s3: the local S3 server at $S3_URL"
.venv/bin/stoker deploy-flows
