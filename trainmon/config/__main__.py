"""``python -m trainmon.config > docs/config.md``: the generated configuration reference."""

from trainmon.config import config_reference

print(config_reference())
