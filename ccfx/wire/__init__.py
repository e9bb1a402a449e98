"""The bottom layer: what crosses the wire between ranks, and how.

Under both the planner (which prices it) and the runtime (which runs it); it imports neither.
One module per concern:

* ``format``: a payload's tensors packed into one ``uint8`` buffer and back (``WireFormat``:
  a pipeline hop's tensor; the ring's chunks use the same packer);
* ``comm``: the ``Comm`` objects exchanges issue collectives through (functional, process
  group, local);
* ``exchange``: a gradient bucket's codec as traceable phases (all-reduce, all-gather, the
  ring, PowerSGD) and ``exchange_for``;
* ``collectives``: a compiled graph's collectives (all-reduce, all-gather, reduce-scatter,
  all-to-all) through a codec, as traceable phases (``CollectiveCall``, ``refuse``,
  ``CompressedCollective``), one module per algorithm;
* ``ring``: the re-encoding ring all-reduce, its byte arithmetic and the
  ``ccfx::ring_all_reduce`` op;
* ``policy``: what is compressible, the bucket policy, the fragment policy;
* ``link``: ``Link`` and the one collective choice (``choose_collective``);
* ``schedules``: torch's GPipe / 1F1B schedules as programs (and ``epilogue_backwards``);
* ``agree``: values ranks agree on through the c10d store, and the groups made for them (the
  names callers use); ``agreement`` (fingerprint-keyed meeting), ``groups`` (making process
  groups), ``blame`` (naming dead or frozen ranks), ``records`` (a rank's record in the
  store), ``fingerprints`` (the one short hash) and ``world`` (is there a process group).

Arrows: codecs <- wire <- planner, runtime <- backends (tests/test_layers.py checks them).
"""
