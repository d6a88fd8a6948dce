"""Placeholder: the configuration-reference directive is generated from conf/."""


def setup(app):  # noqa: ANN001, ANN201
    return {"parallel_read_safe": True}
