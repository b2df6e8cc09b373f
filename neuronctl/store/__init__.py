"""Where artifacts live: the local store, the manifest, gc and remote stores."""
