"""Scheduling and memory bookkeeping: plain Python over integers, no torch."""
