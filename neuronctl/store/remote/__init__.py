"""Remote artifact stores over fsspec: a shared mount (file://), S3 (s3://), the Hub (hf://);
and OCI registries (oci://, oci.py), one OCI artifact per artifact, never through fsspec.

A remote store has the local layout: `<url>/neuron-compiled-artifacts/<dirname>/...`, and the
same completeness rule: an artifact is complete when its manifest.json exists, so push uploads
manifest.json last and pull trusts nothing the manifest does not vouch for.

  client.py     open_remote(URL) -> RemoteStore, what commands hold: its reads, push, pull
  transport.py  the store's files over fsspec: layout and names, capped reads, atomic writes,
                the sha256 a remote object attests, parallel transfers
  push.py       upload an artifact; skip what the remote already holds, manifest.json last
  pull.py       signature first, then every byte against the signed sizes and sha256s
  urls.py       `URL/KEY` of a remote artifact: split, pull into the local store, trust check
  claim.py      one builder per key: a claim created only where none exists (shared mount, S3)
  oci.py        OciStore: an oci://REGISTRY/REPO with the same methods; pull resumes per layer
  oci_layout.py an artifact as an OCI manifest (config, a layer per file, annotations), checked
  oci_registry.py  the registry API through oras-py: auth, timeouts, capped reads, uploads
  oci_ref.py    the oci:// grammar, the plain-HTTP rule, Oracle's object-storage form refused
  errors.py     what fails (the remote, its artifact, this host's disk) as one-line errors
"""
