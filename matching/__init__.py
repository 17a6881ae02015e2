"""Matching: dispatch policies that decide which queued query runs on which instance.

The same policy object runs inside the simulator and (later) inside the live serving loop.
"""
