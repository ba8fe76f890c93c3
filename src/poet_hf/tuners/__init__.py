"""PEFT tuners: one folder per method, each in PEFT's config/layer/model shape."""
