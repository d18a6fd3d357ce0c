"""The site acceptance report: a model scored on a site's labelled cases, with the review rule, the worst cases and
the model's provenance, as one HTML page (:mod:`~feduq.report.site_report`, :mod:`~feduq.report.page`)."""
