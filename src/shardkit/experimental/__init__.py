"""Experimental APIs (kept for fairscale compatibility)."""
