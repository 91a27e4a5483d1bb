"""The sharding engine: how a layer's own code runs on one tensor-parallel rank's shards.

Capture proves a tensor-parallel style with it (in one process, each rank
simulated) and the lowering passes run the very same rules on a device mesh,
so what is offered is what was proved. Neither side owns it: capture and
passes both import this package, and it imports only :mod:`autopar.graph`.

Modules, in the order data flows through them:

``detect``
    finds *candidate* styles in a captured layer's FX nodes (column → row
    projection groups, vocabulary splits);
``layout``
    :class:`~autopar.sharding.layout.Sharded` (which dimension of an
    activation holds a share, cut into which segments) and
    :class:`~autopar.sharding.layout.NoShardRule`;
``whole``
    a fused column projection some of whose segments every rank computes in
    full (GPTBigCode's multi-query key/value rows beside the query's shares);
``ops`` (and ``attention_ops``)
    the rules, op by op (:data:`~autopar.sharding.ops.RULES`,
    :data:`~autopar.sharding.ops.ELEMENTWISE`);
``rules``
    :class:`~autopar.sharding.rules.ShardMode`, the ``TorchFunctionMode``
    that applies a rule to every op the layer runs, and the
    :class:`~autopar.sharding.rules.Collectives` backends (simulated ranks,
    or DTensor on a mesh);
``check``
    runs a layer unsharded and once per simulated rank and compares outputs
    and gradients (:func:`~autopar.sharding.check.check_style`);
``narrow``
    a narrower copy of a large layer's own module with no config, proved to
    run the same program with its widths renamed
    (:func:`~autopar.sharding.narrow.narrow_copy`);
``shapes``
    the rules run at the layer's real size on meta, at every degree offered
    (:func:`~autopar.sharding.shapes.prove_shapes`);
``verify``
    offers a candidate style only once ``check`` proved it on a copy and
    ``shapes`` at the real size (:func:`~autopar.sharding.verify.verify_styles`).

Adding a rule for an op the engine refuses today (the plan's note names it:
"tensor parallelism withdrawn: OP: no sharding rule for this op on a sharded
activation"):

1. If the op maps each element to one element (the shares need no
   change), add its name to ``ELEMENTWISE`` in ``ops.py``; if it only reads
   metadata, to ``METADATA_OPS``.
2. Otherwise write ``_op(mode, name, func, args, kwargs)`` in ``ops.py``: read
   the input's layout with ``mode.layout(x)``; give the op *local* arguments
   (shapes from ``mode.global_shape``, split sizes, index ranges); call
   ``func``; return the result tagged with ``mode.tag(out, layout)``. Where the
   op cannot run exactly on shards (it reduces or normalises over the sharded
   dimension, its view would interleave ranks), ``raise NoShardRule(name,
   "why")``: the style is withdrawn with that reason, never run wrong.
3. Register it in ``RULES`` under every name the op is called by (the
   ``torch.*`` function, the ``Tensor`` method, the in-place form).
4. Copy a test from ``tests/sharding/test_shard_check.py``: a small module using the
   op is proved by ``check_style`` (forward and gradients equal to one
   process), and a deliberately wrong variant is refused.
"""
