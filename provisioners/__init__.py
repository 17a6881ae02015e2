"""Provisioners: adapters that create and destroy instances (EC2, local processes, a fake).

They import nothing else from this repository. The seam is :mod:`provisioners.base` (the
:class:`~provisioners.base.Provisioner` protocol, its records and tags), the errors are in
:mod:`provisioners.errors`; the implementations are :mod:`provisioners.ec2` (boto3),
:mod:`provisioners.local` (worker processes) and :mod:`provisioners.fake` (tests). See
``docs/provisioners.md``.
"""
