"""The composition root: settings -> database -> store -> provisioner -> loops -> scheduler -> API
(``build``), the FastAPI app (``app``), the provisioner the settings name (``provisioning``) and the
demo (``demo``)."""
