"""Engine: requests in, committed tokens out (scheduler, KV-cache bookkeeping, request state)."""
