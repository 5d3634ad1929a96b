"""Experimental nn APIs."""
