"""Structured outputs: grammars that constrain which tokens a request may sample."""
