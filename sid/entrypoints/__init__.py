"""Entry points: the offline ``LLM`` API and the command line."""
