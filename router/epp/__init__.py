"""`pdserve epp`: the Gateway API Inference Extension's endpoint picker for pdserve pools.

An inference gateway (Envoy, and the gateways built on it) asks this process, over Envoy's external
processing protocol (ext_proc, gRPC), which engine pod serves each request. Picking is the
router's own (router/picking.py, balancer.py, prefix.py, feed.py, endpoints.py); the answer is the
header `x-gateway-destination-endpoint` and the same value in the `envoy.lb` dynamic metadata.
With a prefill pool, the picker runs the prefill leg itself and hands the decode engine a body
carrying the returned kv_transfer_params.

Modules: settings (configuration), state (pools, health, feed, picks), request (reading a body),
prefill (the P/D leg), messages (ext_proc answers), processor (the ext_proc stream), metrics,
server (gRPC + HTTP), cli.
"""
