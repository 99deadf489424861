"""KV cache movement for disaggregated prefill/decode: the connector API, its connectors, and the KV store service."""
