"""Local models: config entries, model roots, packaged models (GGUF headers: bunkhouse.gguf)."""

from bunkhouse.catalog.catalog import Catalog, CatalogModel, build_catalog

__all__ = ["Catalog", "CatalogModel", "build_catalog"]
