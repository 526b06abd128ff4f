"""Finding the slow node, NIC or uplink of an allocation (`microbench-doctor`, docs/doctor.md).

`fleet` (the allocation's nodes, racks and rails, the parts a test crosses, what the fabric model expects of
a round), `pair_rounds` (round-robin rounds of disjoint pairs, bounded, and confirmation rounds), `diagnose`
(which tests are slow, which parts are cleared, suspected, confirmed; the next confirmation tests), `survey`
(the rounds-then-confirmation loop, the same for a real job and a simulation), `simulate` (a pure-Python fleet
with planted faults), `measure` (the JAX programs a round runs: every pair of the round in one program), and
`verdict` (the verdict as JSON and a table). Everything but `measure` is JAX-free.
"""
