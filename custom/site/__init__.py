"""FedUQ's 2D site without FLARE's engine: the site (:class:`feduq.site.site2d.Site2D`: data, network, training,
validation, test), what it asks of a method's site part (:mod:`feduq.site.hooks`), its settings and their checks
(:mod:`feduq.site.settings`), the entries it keeps to itself (:mod:`feduq.site.local_entries`), the test protocols
(:mod:`feduq.site.protocol`) and the scoring of a saved model on any site folder (:mod:`feduq.site.evaluation`)."""
