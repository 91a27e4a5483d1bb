"""Rewrite passes that lower a Plan onto torch.distributed for one rank.

Each pass reads only the slice of the Plan it needs. Populated by the lowering
work (stage split, tensor parallel, ZeRO/FSDP2, recompute).
"""
