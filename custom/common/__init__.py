"""What every floor of FedUQ shares and nothing below it: the names that cross the wire between sites and the server
(:mod:`feduq.common.wire`), argument checks whose errors name the argument (:mod:`feduq.common.checks`) and the one
resolver of a dotted class path (:mod:`feduq.common.classpath`). Imports nothing else of FedUQ."""
