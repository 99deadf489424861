#!/usr/bin/env bash
# End to end on a real cluster: build the image, install the chart, serve the demo model, call
# the router, scale decode with `kubectl scale`, delete. See e2e/README.md.
#
#   e2e/kind.sh                      # a throwaway kind cluster (created and deleted here)
#   KIND=0 IMAGE=registry.example/pdserve:e2e PUSH=1 e2e/kind.sh   # the current kubectl context
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KIND=${KIND:-1}                      # 1: create a kind cluster; 0: use the current context
CLUSTER=${CLUSTER:-pdserve-e2e}      # kind cluster name
IMAGE=${IMAGE:-pdserve:e2e}          # built here; loaded into kind, or pushed when PUSH=1
PUSH=${PUSH:-0}
RELEASE=${RELEASE:-pdserve}
SYSTEM_NS=${SYSTEM_NS:-pdserve-system}   # the operator's namespace
NS=${NS:-pdserve-e2e}                    # the InferenceService's namespace
KEEP=${KEEP:-0}                          # 1: leave everything running for a look afterwards
READY_TIMEOUT=${READY_TIMEOUT:-15m}      # engines build the demo model at start
LOCAL_PORT=${LOCAL_PORT:-18000}
ISVC=demo

log() { printf '\n=== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }
need() { command -v "$1" >/dev/null || fail "'$1' is required on PATH"; }

PORT_FORWARD_PID=""
cleanup() {
    local status=$?
    [[ -n "$PORT_FORWARD_PID" ]] && kill "$PORT_FORWARD_PID" 2>/dev/null || true
    if [[ $status -ne 0 ]]; then
        log "failed; state for debugging"
        kubectl get isvc,deployments,pods,services -n "$NS" -o wide || true
        kubectl get isvc "$ISVC" -n "$NS" -o yaml || true
        kubectl logs -n "$SYSTEM_NS" "deployment/$RELEASE-operator" --tail=100 || true
    fi
    if [[ "$KEEP" == 1 ]]; then
        log "KEEP=1: leaving the cluster as it is"
        return
    fi
    kubectl delete isvc "$ISVC" -n "$NS" --ignore-not-found --wait=true || true
    helm uninstall "$RELEASE" -n "$SYSTEM_NS" || true
    if [[ "$KIND" == 1 ]]; then
        kind delete cluster --name "$CLUSTER" || true
    fi
}
trap cleanup EXIT

need docker
need kubectl
need helm
need curl
[[ "$KIND" == 1 ]] && need kind

log "build $IMAGE"
docker build -t "$IMAGE" "$ROOT"

if [[ "$KIND" == 1 ]]; then
    log "kind cluster $CLUSTER"
    kind get clusters | grep -qx "$CLUSTER" || kind create cluster --name "$CLUSTER" --wait 120s
    kubectl config use-context "kind-$CLUSTER"
    # Pods use imagePullPolicy IfNotPresent, so the loaded image is used as is.
    kind load docker-image "$IMAGE" --name "$CLUSTER"
elif [[ "$PUSH" == 1 ]]; then
    log "push $IMAGE"
    docker push "$IMAGE"
fi

log "install the chart (CRD, operator, RBAC)"
helm upgrade --install "$RELEASE" "$ROOT/charts/pdserve" \
    --namespace "$SYSTEM_NS" --create-namespace \
    --set image.repository="${IMAGE%:*}" --set image.tag="${IMAGE##*:}" \
    --set "watchNamespaces={$NS}" \
    --wait --timeout 5m
kubectl wait --for=condition=Established crd/inferenceservices.pdserve.io --timeout=60s

log "apply the sample (demo model) in $NS"
kubectl create namespace "$NS" --dry-run=client -o yaml | kubectl apply -f -
sed -e "s|image: pdserve:latest|image: $IMAGE|" -e "s|namespace: default|namespace: $NS|" \
    "$ROOT/crds/examples/demo.yaml" | kubectl apply -f -

log "wait until $ISVC is Ready"
kubectl wait --for=jsonpath='{.status.phase}'=Ready "isvc/$ISVC" -n "$NS" --timeout="$READY_TIMEOUT"
kubectl get isvc "$ISVC" -n "$NS"
endpoint=$(kubectl get isvc "$ISVC" -n "$NS" -o jsonpath='{.status.endpoint}')
[[ "$endpoint" == "http://$ISVC-router.$NS.svc:8000/v1" ]] || fail "unexpected endpoint '$endpoint'"

log "call the router: POST /v1/completions"
kubectl port-forward -n "$NS" "svc/$ISVC-router" "$LOCAL_PORT:8000" >/dev/null 2>&1 &
PORT_FORWARD_PID=$!
for _ in $(seq 1 30); do
    curl -sf "http://127.0.0.1:$LOCAL_PORT/health" >/dev/null && break
    sleep 1
done
response=$(curl -sf "http://127.0.0.1:$LOCAL_PORT/v1/completions" \
    -H 'Content-Type: application/json' \
    -d '{"model": "demo", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}')
echo "$response"
grep -q '"choices"' <<<"$response" || fail "no choices in the completion"
grep -q '"completion_tokens"' <<<"$response" || fail "no usage in the completion"

log "scale decode through the scale subresource"
kubectl scale isvc/"$ISVC" -n "$NS" --replicas=3
[[ $(kubectl get isvc "$ISVC" -n "$NS" -o jsonpath='{.spec.decode.replicas}') == 3 ]] \
    || fail "kubectl scale did not set spec.decode.replicas"
for _ in $(seq 1 60); do
    [[ $(kubectl get deployment "$ISVC-decode" -n "$NS" -o jsonpath='{.spec.replicas}') == 3 ]] && break
    sleep 2
done
[[ $(kubectl get deployment "$ISVC-decode" -n "$NS" -o jsonpath='{.spec.replicas}') == 3 ]] \
    || fail "the operator did not scale deployment/$ISVC-decode to 3"
[[ $(kubectl get deployment "$ISVC-prefill" -n "$NS" -o jsonpath='{.spec.replicas}') == 1 ]] \
    || fail "scaling decode changed the prefill pool"
kubectl rollout status "deployment/$ISVC-decode" -n "$NS" --timeout="$READY_TIMEOUT"
kubectl wait --for=jsonpath='{.status.decode.ready}'=3/3 "isvc/$ISVC" -n "$NS" --timeout=5m
kubectl get isvc "$ISVC" -n "$NS"

log "delete: owner references take every object with it"
kill "$PORT_FORWARD_PID" 2>/dev/null || true
PORT_FORWARD_PID=""
kubectl delete isvc "$ISVC" -n "$NS" --wait=true
kubectl wait --for=delete "deployment/$ISVC-decode" "deployment/$ISVC-router" -n "$NS" --timeout=2m
[[ -z $(kubectl get deployments,services,configmaps -n "$NS" -l app.kubernetes.io/instance="$ISVC" -o name) ]] \
    || fail "objects of $ISVC are left over"

log "e2e passed"
