"""Framework side: hooks and on-device statistics (torch)."""
