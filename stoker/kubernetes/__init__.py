"""`stoker render --kubernetes`: a spec's serving objects for a Kubernetes cluster, rendered and validated offline
(no API server is reachable from stoker's machines). strategy decides from the spec's GPUs, objects builds each
object as a dict, workpool renders the Prefect Kubernetes pool, validate checks them against the API's schemas."""
