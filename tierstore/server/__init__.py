"""The tierstore storage daemon: a network KV-block service (see README.md here).

``tierstore serve --config configs/daemon.yaml`` runs :func:`tierstore.server.daemon.main`;
engines reach it with :class:`tierstore.client.RemoteKVStore`.
"""
