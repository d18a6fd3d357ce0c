"""Privacy, FLARE-free: differentially private local training with Opacus (:mod:`feduq.privacy.dp_sgd`) and the
privacy ledger's forms and checks of what a site's result may hold (:mod:`feduq.privacy.ledger`). What each method
declares is :mod:`feduq.registry.ledger`; its enforcement on FLARE is :mod:`feduq.flare.ledger`."""
