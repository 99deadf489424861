"""The Kubernetes operator for InferenceService resources (`pdserve operator`).

crd        the CustomResourceDefinition (schema, defaults, CEL rules), built in Python
schema     defaulting and OpenAPI validation, as the API server does them
spec       the resource as typed dataclasses, plus the rules no schema can express
names      object names, labels and ports shared by everything below
commands   the pods' command lines
render     pure rendering: resource in, manifests out
apply      idempotent create-or-patch
status     pure phase and conditions from Deployment states
reconcile  render + apply + status for one resource, over an API client
autoscaler replica decisions from the coordinator's load, and the timer's glue
kube       a small Kubernetes API client and its credentials
handlers   the kopf handlers (thin: they call reconcile and autoscaler)
cli        `pdserve operator run | render | crd`
"""
