"""A replica's figures from HAProxy's server rows (``show stat``): each replica is a server in two
backends, its model's traffic split and its version's own, and its figures are the two added
together (its status is the split's: where its traffic comes from)."""


def replica_figures(rows, owners):
    """{(model, version, replica): requests, 2xx/4xx/5xx, mean response time (ms), status, current
    sessions, socket} from ``rows``; ``owners``: (backend, server) -> ((model, version, replica),
    socket, in the model's backend)."""
    result = {}
    for row in rows:
        key, path, in_model_backend = owners[(row["pxname"], row["svname"])]
        figures = result.setdefault(
            key,
            {
                "requests": 0,
                "2xx": 0,
                "4xx": 0,
                "5xx": 0,
                "sessions": 0,
                "response_ms": 0.0,
                "status": "UP",
                "socket": path,
            },
        )
        count = int(row["stot"] or 0)
        total = figures["requests"] + count
        if total:
            figures["response_ms"] = (
                figures["response_ms"] * figures["requests"] + float(row["rtime"] or 0) * count
            ) / total
        figures["requests"] = total
        for code in ("2xx", "4xx", "5xx"):
            figures[code] += int(row[f"hrsp_{code}"] or 0)
        figures["sessions"] += int(row["scur"] or 0)
        status = row["status"].split()[0]  # "UP 1/2" is UP, going down
        if in_model_backend:
            figures["status"] = status
    return result
