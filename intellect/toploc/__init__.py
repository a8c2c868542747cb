"""TOPLOC: verifiable inference. Workers commit to their final hidden states with small polynomial
proofs (:mod:`~intellect.toploc.proofs`, arithmetic in :mod:`~intellect.toploc.field`); a validator
recomputes the states with one prefill and checks the proofs."""
