"""The wire contract shared by every role: .proto files, their generated stubs,
and the few pure functions every side must agree on (errors, block keys, tensor
encoding). Imports none of cache_node, client or coordinator."""
