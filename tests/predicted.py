"""Bench rows on the emulated cluster against ``weightsync estimate``'s prediction for the
same flags (each ``bench --hosts`` row carries it as ``predicted_s``)."""

# docs/estimate.md promises the prediction within 20% of a run on a quiet machine (the rows
# of BENCHMARKS.md sit within 6%). These tests time up to 10 processes on a 2-core machine
# shared with other runs, and load only ever slows a run down: so the 20% holds as it is
# on the side load cannot explain (a prediction slower than the run), and the run may take
# up to 1.5x the prediction (the 20%, and 25% more for load). The one real miss this check
# found, sharded on 8 hosts before its bucket schedule (BENCHMARKS.md), ran 1.69x its
# prediction: still caught. Speed targets beyond that live in the bench and BENCHMARKS.md.
PROMISED = 0.2
LOADED_RUN = 1.25


def check_predicted(rows):
    for r in rows:
        seconds, predicted = r["seconds"], r["predicted_s"]
        assert predicted <= (1 + PROMISED) * seconds, (r["backend"], "predicted slower", seconds, predicted)
        assert seconds <= (1 + PROMISED) * LOADED_RUN * predicted, (
            r["backend"],
            "ran slower than predicted",
            seconds,
            predicted,
        )
