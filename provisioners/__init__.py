"""Provisioners: adapters that create and destroy instances (EC2, local processes, a fake).

They import nothing else from this repository. Built in the provisioners issue.
"""
