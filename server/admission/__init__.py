"""Admission: which requests the server takes now, which wait and which it refuses at once. The
policies behind one interface (`policy`): `deadline` (`deadline`, its model of the server in
`model`) and `fixed`; the cost of a request (`workload`) measured from what requests were served."""
