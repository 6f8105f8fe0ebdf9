"""The local engine: a `transformers` model served over SGLang's HTTP API (`megatron-rl serve`)."""
