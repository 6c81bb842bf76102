"""What is installed and what upstream already has: versions, source guards, fingerprints.

Standard library only (``packaging`` is used when present), and nothing here
imports a patch target: the listing CLI must run with a bare python3.
"""
