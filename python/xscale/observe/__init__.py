"""What a run tells about itself: where its step time goes (steptime, spans, bounds), which
rank is slow (stragglers), its start-up phases (startup), its rates (throughput), the loss log
and the summary it leaves (runlog), rank 0's progress notes for the goodput ledger (progress), a
failed rank's flight record (flight), the profiler's window and the profile's report
(profile_window, profile_report), and `xscale report` (report, picture)."""
