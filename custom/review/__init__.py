"""The review rule: which predictions a person must review. Case scores and the threshold rule with its familiarity
part (:mod:`~feduq.review.rule`), the per-patient certificate (:mod:`~feduq.review.certificate`), the labelled cases a
rule is chosen on and the site's calibration record (:mod:`~feduq.review.calibration`), the refusal of the model's own
training cases (:mod:`~feduq.review.training_cases`) and the sentences every output says a rule with
(:mod:`~feduq.review.notes`)."""
