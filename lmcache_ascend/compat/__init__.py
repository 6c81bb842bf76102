"""What is installed and what upstream already has: standard library only (``packaging`` when
present), importing no patch target, so the listing CLI runs with a bare python3."""
