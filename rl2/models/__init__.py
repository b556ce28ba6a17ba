"""What some model families need beyond loading: routing record and replay for mixture-of-experts routers
(`routing_replay`), and a per-sequence path for hybrid models' linear-attention layers in packed rows
(`linear_attention`). Both are installed on a loaded model's modules, per instance, and removed again."""
