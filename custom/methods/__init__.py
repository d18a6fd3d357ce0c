"""The methods, one FLARE-free module or folder each: its math and its parts (a site part, a server part, or both),
named by its registration (:mod:`feduq.registry.methods`) and never imported by FLARE's glue."""
