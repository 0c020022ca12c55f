"""deploykit's version: a leaf that the modules recording it import, so nothing inside the
package imports the package root (whose facade imports the workflow on first use)."""

__version__ = "0.1.0"
