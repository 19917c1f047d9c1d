"""`edge-agent bench`: measures this box against peers, in one run, and prints ratios."""
