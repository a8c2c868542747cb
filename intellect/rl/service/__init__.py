"""The submission service and the validator: the trusted door of untrusted workers into a run
(admission, registry, uploads) and the checks of what they submit (verdicts)."""
