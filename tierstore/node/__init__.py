"""The node store (issue 24): one store per node that many engine processes share.

Its lower half is transport and knows nothing of the index (layer 2 of ARCHITECTURE.md):
:mod:`tierstore.node.segment`, the shared memory segment that holds the host tier and staging
slots, and :mod:`tierstore.node.protocol`, the control protocol's framing and closed message
schema. The package's later modules (the node core, service and client) sit in layer 6 and build
on these two. This file imports nothing, so importing either half imports no layer above 1.
"""
