"""DiLoCo: outer loop, elastic membership, int8 codebook quantizer, bandwidth-aware ring order.

Submodules are imported directly (``from intellect.diloco.quantize import quantize``);
nothing is re-exported here, so importing one never pulls in the others.
"""
