"""The shared step cache (opt-in, `storage.shared_cache`): the local StepStore in front of an S3 layer.

  remote.py  the S3 layer: `<prefix>/cache/<step>/<key>/` with blobs first and record.json (the marker) last
  lease.py   one builder per key across processes and hosts: a conditional-put lease, renewed while it works
  shared.py  local → remote → lease → produce, publish locally, upload
  sweep.py   what killed steps leave: local `.tmp-*` folders, remote marker-less blobs and multipart uploads
  prune.py   which entries `stoker cache prune` removes (pure), and what live deployments serve
"""
