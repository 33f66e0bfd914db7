"""Side-by-side benchmarks: each ``python -m bench.<name>`` prints one JSON line (name, settings, figures, ratio).

``make bench`` runs them all and writes docs/benchmarks.md (:mod:`bench.report`). Ours and the baseline are measured
interleaved in the same run, so the ratios hold on a noisy shared machine. Nothing here is a timed test.
"""
