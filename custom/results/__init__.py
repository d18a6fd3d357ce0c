"""Results of finished runs, FLARE-free: paired tests of methods on the same test images (:mod:`feduq.results.paired`),
a sweep's tables and figures (:mod:`feduq.results.sweeps`), one report per comparison (:mod:`feduq.results.report`)
and leave-one-site-out (:mod:`feduq.results.holdout`)."""
