"""Runtime: model runner, attention backends, sampling."""
