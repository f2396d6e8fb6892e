"""Plan search: candidates (mesh x rules x remat), validation, compiled-program scores, a cost model, a ranking."""
