"""The two pieces a method plugs into FedUQ, FLARE-free: the site part (:class:`feduq.parts.site.SitePart`, the CT
one :class:`feduq.parts.site.CTSitePart`) and the server part (:class:`feduq.parts.server.ServerPart`, the CT one
:class:`feduq.parts.ct_server.CTServer`), with FedAvg's behaviour as their defaults. A method in
:mod:`feduq.methods` subclasses them; the FLARE executor and controller (:mod:`feduq.flare`) run them."""
