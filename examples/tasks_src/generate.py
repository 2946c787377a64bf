#!/usr/bin/env python3
"""Deterministic generator for the bundled Harbor task suite in ../tasks/.

Run once (``python3 examples/tasks_src/generate.py``); it rewrites every task folder
``examples/tasks/<task_id>/`` from scratch: instruction.md, task.toml, environment/
(Dockerfile + data/), solution/solve.sh and tests/ (test.sh + the shared grade.py).

Each task's gold answer is computed here, by Python code that is independent of the
task's solution/solve.sh (which recomputes it from the data files inside the sandbox);
an oracle run scoring 1.0 therefore cross-checks the two.  Standard library only.
"""

from __future__ import annotations

import csv
import io
import json
import random
import shutil
import statistics
from collections import Counter, defaultdict
from datetime import UTC, date, datetime, timedelta, timezone
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS_DIR = HERE.parent / "tasks"
GRADER = (HERE / "grade.py").read_text()
TEST_SH_TMPL = (HERE / "test.sh.tmpl").read_text()
SEED = 20261129

FIRST = [
    "Ava", "Liam", "Noah", "Emma", "Olivia", "Mateo", "Sofia", "Lucas", "Mia", "Ethan",
    "Amara", "Kenji", "Priya", "Omar", "Zara", "Felix", "Ines", "Hugo", "Leila", "Tariq",
    "Nora", "Ivan", "Chloe", "Diego", "Hana", "Jonas", "Maya", "Ravi", "Elena", "Samir",
]
LAST = [
    "Garcia", "Smith", "Nguyen", "Khan", "Muller", "Rossi", "Silva", "Kowalski", "Tanaka",
    "Okafor", "Larsen", "Dubois", "Novak", "Haddad", "Brennan", "Costa", "Ivanova", "Park",
    "Mendes", "Fischer", "Alvarez", "Singh", "Moreau", "Berg", "Rahman",
]


def csv_text(header: list[str], rows: list[list]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(header)
    w.writerows(rows)
    return buf.getvalue()


def money(x: float) -> str:
    return f"{x:.2f}"


def r2(x: float) -> str:
    return f"{x:.2f}"


# --------------------------------------------------------------------------------------
# Task definitions. Each builder returns a dict:
#   files: {relative path under environment/data: text}
#   gold: str, mode: exact_short|numeric, atol, rtol
#   title, question (markdown), data_desc (markdown list), answer_format (sentence)
#   solve: python source run by solution/solve.sh (cwd /workdir)
#   difficulty, category, tags, and optional: network (None=omit|public|no-network),
#   reward_json (bool), pip (list of requirement strings)
# --------------------------------------------------------------------------------------


def t_orders_count(rng: random.Random) -> dict:
    n = rng.randint(380, 470)
    cities = ["Portland, OR", "Austin, TX", "Denver, CO", "Boston, MA", "Miami, FL",
              "Seattle, WA", "Chicago, IL"]
    rows = []
    start = date(2024, 1, 1)
    for i in range(n):
        rows.append([
            f"ORD-{10000 + i}",
            f"C{rng.randint(1, 180):04d}",
            (start + timedelta(days=rng.randint(0, 180))).isoformat(),
            rng.choice(cities),
            rng.choice(["shipped", "pending", "cancelled", "delivered"]),
            money(rng.uniform(5, 400)),
        ])
    text = csv_text(["order_id", "customer_id", "order_date", "ship_to", "status", "amount"], rows)
    return dict(
        files={"orders.csv": text},
        gold=str(n), mode="numeric", atol="0", rtol="0",
        title="Count the orders",
        question="How many orders are recorded in `/workdir/data/orders.csv`? "
                 "Count data rows only (not the header line).",
        data_desc="- `orders.csv` — one order per row; columns `order_id, customer_id, "
                  "order_date, ship_to, status, amount`. Some fields are quoted because they "
                  "contain commas.",
        answer_format="Write the count as a plain integer.",
        solve="""
import csv
with open("data/orders.csv", newline="") as fh:
    n = sum(1 for _ in csv.DictReader(fh))
open("answer.txt", "w").write(f"{n}\\n")
""",
        difficulty=1, category="data-analysis", tags=["csv", "count"],
        network=None,  # default policy (public) on purpose
    )


def t_priciest_product(rng: random.Random) -> dict:
    adjectives = ["Compact", "Deluxe", "Ergonomic", "Portable", "Smart", "Classic", "Titanium",
                  "Wireless", "Modular", "Eco", "Premium", "Rugged"]
    nouns = ["Desk Lamp", "Kettle", "Backpack", "Monitor Arm", "Blender", "Headphones",
             "Office Chair", "Air Purifier", "Standing Desk", "Espresso Machine", "Drill",
             "Bookshelf", "Tent", "Router", "Speaker"]
    cats = {"Desk Lamp": "Home", "Kettle": "Kitchen", "Backpack": "Outdoor",
            "Monitor Arm": "Office", "Blender": "Kitchen", "Headphones": "Electronics",
            "Office Chair": "Office", "Air Purifier": "Home", "Standing Desk": "Office",
            "Espresso Machine": "Kitchen", "Drill": "Tools", "Bookshelf": "Home",
            "Tent": "Outdoor", "Router": "Electronics", "Speaker": "Electronics"}
    names = set()
    while len(names) < 110:
        names.add(f"{rng.choice(adjectives)} {rng.choice(nouns)}")
    names = sorted(names)
    rng.shuffle(names)
    prices = {nm: round(rng.uniform(9, 980), 2) for nm in names}
    # a few items in the 900s so that sorting prices as strings picks the wrong one
    for nm in names[:4]:
        prices[nm] = round(rng.uniform(900, 999.99), 2)
    top = names[7]
    prices[top] = round(rng.uniform(1180, 1320), 2)
    rows = []
    for i, nm in enumerate(names):
        noun = next(k for k in cats if nm.endswith(k))
        rows.append([f"SKU-{4000 + i * 7}", nm, cats[noun], money(prices[nm]), rng.randint(0, 250)])
    ranked = sorted(prices.values(), reverse=True)
    assert ranked[0] - ranked[1] > 100
    assert max(rows, key=lambda r: r[3])[1] != top  # string comparison trap is live
    return dict(
        files={"products.csv": csv_text(["sku", "name", "category", "unit_price", "stock"], rows)},
        gold=top, mode="exact_short", atol="0", rtol="0",
        title="Most expensive product",
        question="Which product in `/workdir/data/products.csv` has the highest `unit_price`?",
        data_desc="- `products.csv` — product catalogue; columns `sku, name, category, "
                  "unit_price, stock` (`unit_price` in US dollars).",
        answer_format="Write the product's `name` exactly as it appears in the file.",
        solve="""
import csv
with open("data/products.csv", newline="") as fh:
    best = max(csv.DictReader(fh), key=lambda r: float(r["unit_price"]))
open("answer.txt", "w").write(best["name"] + "\\n")
""",
        difficulty=1, category="data-analysis", tags=["csv", "argmax"],
        network="public",
    )


def t_http_500_count(rng: random.Random) -> dict:
    paths = ["/api/users", "/api/orders", "/api/cart", "/login", "/health", "/api/search",
             "/static/app.js", "/api/payments"]
    statuses = [200] * 70 + [201] * 6 + [204] * 4 + [301] * 3 + [304] * 5 + [400] * 3 + \
               [401] * 2 + [404] * 6 + [500] * 3 + [502] * 2 + [503] * 2
    t0 = datetime(2024, 5, 14, 8, 0, 0, tzinfo=UTC)
    rows = []
    n = 900
    for i in range(n):
        t0 += timedelta(seconds=rng.randint(1, 40))
        rows.append([t0.strftime("%Y-%m-%dT%H:%M:%SZ"), rng.choice(["GET"] * 4 + ["POST", "PUT"]),
                     rng.choice(paths), rng.choice(statuses), rng.randint(3, 2400)])
    gold = sum(1 for r in rows if r[3] == 500)
    assert gold != sum(1 for r in rows if r[3] >= 500)
    return dict(
        files={"requests.csv": csv_text(["timestamp", "method", "path", "status", "latency_ms"], rows)},
        gold=str(gold), mode="numeric", atol="0", rtol="0",
        title="Count internal server errors",
        question="How many requests in the web-server log `/workdir/data/requests.csv` returned "
                 "HTTP status code exactly `500`?",
        data_desc="- `requests.csv` — one HTTP request per row; columns `timestamp, method, path, "
                  "status, latency_ms`.",
        answer_format="Write the count as a plain integer.",
        solve="""
import csv
with open("data/requests.csv", newline="") as fh:
    n = sum(1 for r in csv.DictReader(fh) if r["status"].strip() == "500")
open("answer.txt", "w").write(f"{n}\\n")
""",
        difficulty=1, category="log-analysis", tags=["csv", "filter", "count"],
    )


def t_west_completed_revenue(rng: random.Random) -> dict:
    products = {"Widget": 12.5, "Gadget": 29.99, "Gizmo": 7.25, "Doohickey": 54.0,
                "Sprocket": 3.8, "Flange": 16.4}
    rows = []
    for i in range(650):
        p = rng.choice(list(products))
        price = round(products[p] * rng.uniform(0.9, 1.1), 2)
        rows.append([f"S{50000 + i}", (date(2024, 1, 1) + timedelta(days=rng.randint(0, 300))).isoformat(),
                     rng.choice(["North", "South", "East", "West"]), p, rng.randint(1, 20),
                     money(price), rng.choice(["completed"] * 6 + ["refunded", "pending"])])
    gold = sum(r[4] * float(r[5]) for r in rows if r[2] == "West" and r[6] == "completed")
    return dict(
        files={"sales.csv": csv_text(["order_id", "order_date", "region", "product", "quantity",
                                      "unit_price", "status"], rows)},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="Completed revenue in the West region",
        question="Using `/workdir/data/sales.csv`, what is the total revenue of orders in the "
                 "`West` region whose status is `completed`? Revenue of an order is "
                 "`quantity × unit_price`.",
        data_desc="- `sales.csv` — columns `order_id, order_date, region, product, quantity, "
                  "unit_price, status`.",
        answer_format="Write the total as a number rounded to 2 decimal places (no currency sign).",
        solve="""
import csv
total = 0.0
with open("data/sales.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["region"] == "West" and r["status"] == "completed":
            total += int(r["quantity"]) * float(r["unit_price"])
open("answer.txt", "w").write(f"{total:.2f}\\n")
""",
        difficulty=2, category="data-analysis", tags=["csv", "filter", "sum"],
    )


def t_scifi_avg_rating(rng: random.Random) -> dict:
    genres = ["Science Fiction", "Fantasy", "Mystery", "Romance", "History", "Biography"]
    words = ["Silent", "Crimson", "Last", "Hidden", "Glass", "Iron", "Distant", "Broken",
             "Golden", "Lost", "Quiet", "Burning"]
    things = ["Orbit", "Garden", "Empire", "Archive", "River", "Signal", "Kingdom", "Harbor",
              "Machine", "Letters", "Frontier", "Tide"]
    books = []
    for i in range(260):
        genre, year = rng.choice(genres), rng.randint(1975, 2024)
        lo = 2.9 if (genre == "Science Fiction" and year >= 2010) else 2.0
        books.append({
            "id": i + 1,
            "title": f"The {rng.choice(words)} {rng.choice(things)}",
            "author": f"{rng.choice(FIRST)} {rng.choice(LAST)}",
            "genre": genre,
            "year": year,
            "rating": round(rng.uniform(lo, 5.0), 1),
            "pages": rng.randint(120, 900),
        })
    sel = [b["rating"] for b in books if b["genre"] == "Science Fiction" and b["year"] >= 2010]
    allsf = [b["rating"] for b in books if b["genre"] == "Science Fiction"]
    gold = statistics.mean(sel)
    assert abs(gold - statistics.mean(allsf)) > 0.02
    return dict(
        files={"books.json": json.dumps({"library": "Northside Branch", "books": books}, indent=1)},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="Average rating of recent science fiction",
        question="In `/workdir/data/books.json`, what is the average `rating` of books whose "
                 "`genre` is `Science Fiction` and that were published (`year`) in 2010 or later?",
        data_desc="- `books.json` — an object with a `books` list; each book has `id, title, "
                  "author, genre, year, rating, pages`.",
        answer_format="Write the average as a number rounded to 2 decimal places.",
        solve="""
import json
books = json.load(open("data/books.json"))["books"]
sel = [b["rating"] for b in books if b["genre"] == "Science Fiction" and b["year"] >= 2010]
open("answer.txt", "w").write(f"{sum(sel) / len(sel):.2f}\\n")
""",
        difficulty=2, category="data-analysis", tags=["json", "filter", "mean"],
    )


def t_low_stock_value(rng: random.Random) -> dict:
    items = ["bolt", "nut", "washer", "hinge", "bracket", "spring", "gasket", "valve", "fuse",
             "relay", "cable", "switch", "bearing", "pulley", "clamp"]
    rows = []
    for i in range(320):
        reorder = rng.randint(10, 80)
        qty = rng.randint(0, 160)
        rows.append([f"IT-{3000 + i}", f"{rng.choice(items)}-{rng.choice('ABCDEFGH')}{rng.randint(1, 99)}",
                     rng.choice(["WH-North", "WH-South", "WH-East", "WH-Central"]), qty,
                     money(rng.uniform(0.2, 45)), reorder])
    for r in rows[5:300:40]:  # some items sit exactly at their reorder level
        r[2], r[3] = "WH-North", r[5]
    gold = sum(r[3] * float(r[4]) for r in rows if r[2] == "WH-North" and r[3] < r[5])
    wrong = sum(r[3] * float(r[4]) for r in rows if r[2] == "WH-North" and r[3] <= r[5])
    assert abs(gold - wrong) > 1
    return dict(
        files={"inventory.csv": csv_text(["item_id", "item_name", "warehouse", "qty", "unit_cost",
                                          "reorder_level"], rows)},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="Value of low-stock items in WH-North",
        question="In `/workdir/data/inventory.csv`, consider the items stored in warehouse "
                 "`WH-North` whose `qty` is strictly below their `reorder_level`. What is the total "
                 "stock value of those items, where an item's value is `qty × unit_cost`?",
        data_desc="- `inventory.csv` — columns `item_id, item_name, warehouse, qty, unit_cost, "
                  "reorder_level`.",
        answer_format="Write the total as a number rounded to 2 decimal places (no currency sign).",
        solve="""
import csv
total = 0.0
with open("data/inventory.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["warehouse"] == "WH-North" and int(r["qty"]) < int(r["reorder_level"]):
            total += int(r["qty"]) * float(r["unit_cost"])
open("answer.txt", "w").write(f"{total:.2f}\\n")
""",
        difficulty=2, category="data-analysis", tags=["csv", "filter", "sum"],
        reward_json=True,
    )


def t_top_category_revenue(rng: random.Random) -> dict:
    cats = ["Groceries", "Electronics", "Apparel", "Toys", "Garden", "Books", "Beauty", "Sports"]
    spend = {"Groceries": (3, 40), "Electronics": (40, 260), "Apparel": (10, 90), "Toys": (5, 60),
             "Garden": (8, 120), "Books": (5, 35), "Beauty": (6, 55), "Sports": (15, 150)}
    weights = [30, 9, 14, 10, 8, 12, 9, 8]
    rows = []
    for i in range(950):
        c = rng.choices(cats, weights)[0]
        lo, hi = spend[c]
        rows.append([f"T{700000 + i}", (date(2024, 2, 1) + timedelta(days=rng.randint(0, 120))).isoformat(),
                     rng.choice(["Downtown", "Airport", "Mall", "Riverside"]), c,
                     money(rng.uniform(lo, hi))])
    totals = defaultdict(float)
    for r in rows:
        totals[r[3]] += float(r[4])
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    gold = ranked[0][0]
    assert ranked[0][1] - ranked[1][1] > 200
    assert Counter(r[3] for r in rows).most_common(1)[0][0] != gold
    return dict(
        files={"transactions.csv": csv_text(["txn_id", "date", "store", "category", "amount"], rows)},
        gold=gold, mode="exact_short", atol="0", rtol="0",
        title="Category with the highest revenue",
        question="Using `/workdir/data/transactions.csv`, which `category` has the largest total "
                 "`amount` summed over all transactions?",
        data_desc="- `transactions.csv` — one sale per row; columns `txn_id, date, store, "
                  "category, amount`.",
        answer_format="Write the category name exactly as it appears in the file.",
        solve="""
import csv
from collections import defaultdict
totals = defaultdict(float)
with open("data/transactions.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        totals[r["category"]] += float(r["amount"])
open("answer.txt", "w").write(max(totals, key=totals.get) + "\\n")
""",
        difficulty=3, category="data-analysis", tags=["csv", "group-by", "argmax"],
    )


def t_highest_median_salary(rng: random.Random) -> dict:
    depts = {"Engineering": (98000, 9000), "Sales": (74000, 8000), "Marketing": (78000, 7000),
             "Finance": (105000, 6000), "Support": (56000, 5000), "Legal": (96000, 8000)}
    rows = []
    for i in range(270):
        d = rng.choice(list(depts))
        mu, sd = depts[d]
        sal = int(rng.gauss(mu, sd) / 100) * 100
        rows.append([f"E{1000 + i}", f"{rng.choice(FIRST)} {rng.choice(LAST)}", d,
                     rng.choice(["Associate", "Senior", "Lead", "Manager"]), sal,
                     (date(2012, 1, 1) + timedelta(days=rng.randint(0, 4400))).isoformat()])
    # a couple of executives inflate Engineering's mean but not its median
    for j, sal in enumerate([410000, 385000, 350000]):
        rows.append([f"E{2000 + j}", f"{rng.choice(FIRST)} {rng.choice(LAST)}", "Engineering",
                     "Vice President", sal, "2015-06-01"])
    rng.shuffle(rows)
    by = defaultdict(list)
    for r in rows:
        by[r[2]].append(r[4])
    med = {d: statistics.median(v) for d, v in by.items()}
    mean = {d: statistics.mean(v) for d, v in by.items()}
    ranked = sorted(med.items(), key=lambda kv: -kv[1])
    gold = ranked[0][0]
    assert ranked[0][1] - ranked[1][1] >= 1000
    assert max(mean, key=mean.get) != gold
    return dict(
        files={"employees.csv": csv_text(["emp_id", "name", "department", "title", "salary",
                                          "hire_date"], rows)},
        gold=gold, mode="exact_short", atol="0", rtol="0",
        title="Department with the highest median salary",
        question="Using `/workdir/data/employees.csv`, which `department` has the highest "
                 "**median** `salary`?",
        data_desc="- `employees.csv` — one employee per row; columns `emp_id, name, department, "
                  "title, salary, hire_date` (`salary` in US dollars per year).",
        answer_format="Write the department name exactly as it appears in the file.",
        solve="""
import csv, statistics
from collections import defaultdict
by = defaultdict(list)
with open("data/employees.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        by[r["department"]].append(float(r["salary"]))
med = {d: statistics.median(v) for d, v in by.items()}
open("answer.txt", "w").write(max(med, key=med.get) + "\\n")
""",
        difficulty=3, category="data-analysis", tags=["csv", "group-by", "median"],
    )


def t_station_member_duration(rng: random.Random) -> dict:
    stations = ["Harbor Sq", "Elm St", "City Hall", "Museum", "Union Stn", "Park Ave",
                "Library", "Stadium", "Market", "Riverside"]
    base = {s: rng.uniform(9, 22) for s in stations}
    rows = []
    for i in range(1000):
        s = rng.choice(stations)
        rt = rng.choice(["member"] * 3 + ["casual"] * 2)
        dur = max(1.0, rng.gauss(base[s] * (1.6 if rt == "casual" else 1.0), 4))
        rows.append([f"TR{90000 + i}", s, rng.choice(stations), rt, f"{dur:.1f}"])
    # a quiet station with a handful of very long member trips (excluded by the >=25 rule)
    for j in range(6):
        rows.append([f"TR{99000 + j}", "Observatory", rng.choice(stations), "member",
                     f"{rng.uniform(45, 70):.1f}"])
    rng.shuffle(rows)
    by = defaultdict(list)
    for r in rows:
        if r[3] == "member":
            by[r[1]].append(float(r[4]))
    elig = {s: statistics.mean(v) for s, v in by.items() if len(v) >= 25}
    ranked = sorted(elig.values(), reverse=True)
    assert ranked[0] - ranked[1] > 0.05
    assert "Observatory" not in elig
    return dict(
        files={"trips.csv": csv_text(["trip_id", "start_station", "end_station", "rider_type",
                                      "duration_min"], rows)},
        gold=r2(ranked[0]), mode="numeric", atol="0.01", rtol="0",
        title="Longest average member trip by start station",
        question="Using `/workdir/data/trips.csv`, consider only trips with `rider_type` "
                 "`member`. Among start stations with **at least 25** such member trips, find the "
                 "station whose member trips have the highest average `duration_min`. What is that "
                 "average duration in minutes?",
        data_desc="- `trips.csv` — bike-share trips; columns `trip_id, start_station, end_station, "
                  "rider_type, duration_min`.",
        answer_format="Write the average as a number of minutes rounded to 2 decimal places.",
        solve="""
import csv
from collections import defaultdict
by = defaultdict(list)
with open("data/trips.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["rider_type"] == "member":
            by[r["start_station"]].append(float(r["duration_min"]))
best = max(sum(v) / len(v) for v in by.values() if len(v) >= 25)
open("answer.txt", "w").write(f"{best:.2f}\\n")
""",
        difficulty=3, category="data-analysis", tags=["csv", "group-by", "mean", "threshold"],
    )


def t_country_top_spend(rng: random.Random) -> dict:
    countries = ["Germany", "Brazil", "Japan", "Canada", "India", "Kenya", "Mexico", "Norway"]
    cw = [20, 14, 12, 12, 16, 8, 10, 8]
    customers = []
    for i in range(160):
        customers.append([f"C{i + 1:04d}", f"{rng.choice(FIRST)} {rng.choice(LAST)}",
                          rng.choices(countries, cw)[0],
                          (date(2021, 1, 1) + timedelta(days=rng.randint(0, 1000))).isoformat()])
    country_of = {c[0]: c[2] for c in customers}
    big = {"Japan": 1.0, "Norway": 1.0}
    orders = []
    for i in range(720):
        cid = rng.choice(customers)[0]
        amt = rng.uniform(10, 300) * (1.9 if country_of[cid] in big else 1.0)
        orders.append([f"O{30000 + i}", cid, money(amt),
                       rng.choice(["shipped"] * 5 + ["cancelled", "returned"])])
    # a burst of cancelled German orders: Germany leads only if status is ignored
    german = [c[0] for c in customers if c[2] == "Germany"]
    for j in range(40):
        orders.append([f"O{39000 + j}", rng.choice(german), money(rng.uniform(200, 400)), "cancelled"])
    rng.shuffle(orders)
    shipped, anyst = defaultdict(float), defaultdict(float)
    for o in orders:
        anyst[country_of[o[1]]] += float(o[2])
        if o[3] == "shipped":
            shipped[country_of[o[1]]] += float(o[2])
    ranked = sorted(shipped.items(), key=lambda kv: -kv[1])
    gold = ranked[0][0]
    assert ranked[0][1] - ranked[1][1] > 300
    assert max(anyst, key=anyst.get) != gold
    assert Counter(country_of.values()).most_common(1)[0][0] != gold
    return dict(
        files={"customers.csv": csv_text(["customer_id", "name", "country", "signup_date"], customers),
               "orders.csv": csv_text(["order_id", "customer_id", "amount", "status"], orders)},
        gold=gold, mode="exact_short", atol="0", rtol="0",
        title="Country with the highest shipped spend",
        question="Customers are listed in `/workdir/data/customers.csv` and their orders in "
                 "`/workdir/data/orders.csv`. Considering only orders with status `shipped`, which "
                 "customer `country` has the largest total order `amount`?",
        data_desc="- `customers.csv` — columns `customer_id, name, country, signup_date`.\n"
                  "- `orders.csv` — columns `order_id, customer_id, amount, status`.",
        answer_format="Write the country name exactly as it appears in the file.",
        solve="""
import csv
from collections import defaultdict
with open("data/customers.csv", newline="") as fh:
    country = {r["customer_id"]: r["country"] for r in csv.DictReader(fh)}
totals = defaultdict(float)
with open("data/orders.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if r["status"] == "shipped":
            totals[country[r["customer_id"]]] += float(r["amount"])
open("answer.txt", "w").write(max(totals, key=totals.get) + "\\n")
""",
        difficulty=4, category="data-analysis", tags=["csv", "join", "group-by", "argmax"],
    )


def t_supplier_profit(rng: random.Random) -> dict:
    suppliers = ["Northwind Traders", "Acme Corp", "Globex", "Initech", "Umbrella Supply"]
    kinds = ["Tea", "Coffee", "Cocoa", "Honey", "Syrup", "Jam", "Biscuits", "Noodles", "Rice",
             "Olive Oil", "Vinegar", "Spices"]
    products = []
    for i in range(84):
        products.append([f"P{i + 1:03d}", f"{rng.choice(kinds)} #{i + 1}", rng.choice(suppliers),
                         money(rng.uniform(1.5, 30))])
    cost = {p[0]: float(p[3]) for p in products}
    sales = []
    for i in range(460):
        p = rng.choice(products)
        sales.append({"sale_id": 80000 + i, "product_id": p[0], "qty": rng.randint(1, 24),
                      "unit_price": round(cost[p[0]] * rng.uniform(1.05, 1.8), 2),
                      "returned": rng.random() < 0.12})
    target = "Northwind Traders"
    sup = {p[0]: p[2] for p in products}
    gold = sum(s["qty"] * (s["unit_price"] - cost[s["product_id"]]) for s in sales
               if sup[s["product_id"]] == target and not s["returned"])
    with_returns = sum(s["qty"] * (s["unit_price"] - cost[s["product_id"]]) for s in sales
                       if sup[s["product_id"]] == target)
    assert abs(gold - with_returns) > 1
    return dict(
        files={"products.csv": csv_text(["product_id", "name", "supplier", "unit_cost"], products),
               "sales.json": '{"currency": "USD", "sales": [\n'
                              + ",\n".join(json.dumps(s) for s in sales) + "\n]}\n"},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="Profit on one supplier's products",
        question="Products and their unit costs are in `/workdir/data/products.csv`; individual "
                 "sales are in `/workdir/data/sales.json`. What is the total profit on sales of "
                 "products supplied by `Northwind Traders`, excluding sales that were returned? "
                 "The profit of a sale is `qty × (unit_price − unit_cost)`.",
        data_desc="- `products.csv` — columns `product_id, name, supplier, unit_cost`.\n"
                  "- `sales.json` — an object whose `sales` list holds records with `sale_id, "
                  "product_id, qty, unit_price, returned` (`returned` is a boolean).",
        answer_format="Write the profit as a number rounded to 2 decimal places (no currency sign).",
        solve="""
import csv, json
with open("data/products.csv", newline="") as fh:
    prods = {r["product_id"]: r for r in csv.DictReader(fh)}
total = 0.0
for s in json.load(open("data/sales.json"))["sales"]:
    p = prods[s["product_id"]]
    if p["supplier"] == "Northwind Traders" and not s["returned"]:
        total += s["qty"] * (s["unit_price"] - float(p["unit_cost"]))
open("answer.txt", "w").write(f"{total:.2f}\\n")
""",
        difficulty=4, category="data-analysis", tags=["csv", "json", "join", "sum"],
        reward_json=True,
    )


def t_cohort_stats_average(rng: random.Random) -> dict:
    cohorts = ["Falcon", "Heron", "Osprey", "Kestrel"]
    students = []
    for i in range(200):
        students.append([f"S{i + 1:04d}", f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.choice(cohorts)])
    courses = ["Statistics", "Calculus", "Programming", "Economics"]
    grades = []
    for s in students:
        for c in rng.sample(courses, rng.randint(2, 4)):
            grades.append([s[0], c, rng.randint(35, 100)])
    rng.shuffle(grades)
    cohort_of = {s[0]: s[2] for s in students}
    sel = [g[2] for g in grades if g[1] == "Statistics" and cohort_of[g[0]] == "Falcon"]
    gold = statistics.mean(sel)
    assert abs(gold - statistics.mean(g[2] for g in grades if g[1] == "Statistics")) > 0.02
    return dict(
        files={"students.csv": csv_text(["student_id", "name", "cohort"], students),
               "grades.csv": csv_text(["student_id", "course", "score"], grades)},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="Average Statistics score of one cohort",
        question="Students are listed in `/workdir/data/students.csv` and course scores in "
                 "`/workdir/data/grades.csv`. What is the average `score` in the course "
                 "`Statistics` over students in cohort `Falcon`?",
        data_desc="- `students.csv` — columns `student_id, name, cohort`.\n"
                  "- `grades.csv` — one score per row; columns `student_id, course, score`.",
        answer_format="Write the average as a number rounded to 2 decimal places.",
        solve="""
import csv
with open("data/students.csv", newline="") as fh:
    cohort = {r["student_id"]: r["cohort"] for r in csv.DictReader(fh)}
with open("data/grades.csv", newline="") as fh:
    sel = [float(r["score"]) for r in csv.DictReader(fh)
           if r["course"] == "Statistics" and cohort.get(r["student_id"]) == "Falcon"]
open("answer.txt", "w").write(f"{sum(sel) / len(sel):.2f}\\n")
""",
        difficulty=4, category="data-analysis", tags=["csv", "join", "mean"],
    )


def t_late_invoices(rng: random.Random) -> dict:
    clients = ["Blue Fern LLC", "Copperline", "Delta Foods", "Everbright", "Fjord Media",
               "Granite Works", "Helio Labs", "Juniper & Co"]
    fmts = ["%Y-%m-%d", "%B %d, %Y", "%d %b %Y", "%Y/%m/%d", "%b %d %Y", "%A, %d %B %Y"]

    def fmt(d: date) -> str:
        return d.strftime(rng.choice(fmts))

    rows = []
    for i in range(230):
        issued = date(2023, 9, 1) + timedelta(days=rng.randint(0, 330))
        delay = rng.choice([rng.randint(3, 29), rng.randint(29, 32), rng.randint(31, 95)])
        paid = "" if rng.random() < 0.1 else fmt(issued + timedelta(days=delay))
        rows.append([f"INV-{2400 + i}", rng.choice(clients), fmt(issued), paid,
                     money(rng.uniform(150, 9500)), delay])
    gold = sum(float(r[4]) for r in rows if r[3] and r[5] > 30)
    naive = sum(float(r[4]) for r in rows if r[3] and r[5] >= 30)
    assert abs(gold - naive) > 1
    assert all(r[2] for r in rows)
    out = [r[:5] for r in rows]
    return dict(
        files={"invoices.csv": csv_text(["invoice_id", "client", "issued", "paid", "amount"], out)},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="Total of invoices paid late",
        question="`/workdir/data/invoices.csv` lists invoices with the date each was `issued` and "
                 "the date it was `paid` (empty if still unpaid). The dates were typed in by hand "
                 "and use several different formats. An invoice counts as *paid late* when it was "
                 "paid **more than 30 days** after it was issued (a 30-day gap is on time). What is "
                 "the total `amount` of all invoices paid late? Unpaid invoices do not count.\n\n"
                 "The `python-dateutil` package is installed in this environment if you want a "
                 "forgiving date parser.",
        data_desc="- `invoices.csv` — columns `invoice_id, client, issued, paid, amount`.",
        answer_format="Write the total as a number rounded to 2 decimal places (no currency sign).",
        solve="""
import csv
from dateutil import parser
total = 0.0
with open("data/invoices.csv", newline="") as fh:
    for r in csv.DictReader(fh):
        if not r["paid"].strip():
            continue
        gap = (parser.parse(r["paid"]) - parser.parse(r["issued"])).days
        if gap > 30:
            total += float(r["amount"])
open("answer.txt", "w").write(f"{total:.2f}\\n")
""",
        difficulty=5, category="data-analysis", tags=["csv", "dates", "parsing", "apt"],
        apt=["python3-dateutil"],
    )


def t_building_b_humidity(rng: random.Random) -> dict:
    offsets = [UTC, timezone(timedelta(hours=-5)), timezone(timedelta(hours=2)),
               timezone(timedelta(hours=9)), timezone(timedelta(hours=-8))]
    sites = []
    sid = 0
    for b in ["A", "B", "C"]:
        for k in range(3):
            sensors = []
            for t in ["humidity", "temperature", "humidity"] + (["co2"] if k == 0 else []):
                sid += 1
                tz = rng.choice(offsets)
                readings = []
                # readings from mid-February to mid-April, denser around month edges
                for _ in range(rng.randint(20, 30)):
                    if rng.random() < 0.35:
                        edge = rng.choice([datetime(2024, 3, 1, tzinfo=UTC),
                                           datetime(2024, 4, 1, tzinfo=UTC)])
                        ts_utc = edge + timedelta(minutes=rng.randint(-600, 600))
                    else:
                        ts_utc = datetime(2024, 2, 15, tzinfo=UTC) + timedelta(
                            minutes=rng.randint(0, 60 * 24 * 60))
                    base = {"humidity": 45, "temperature": 21, "co2": 600}[t]
                    val = round(base + rng.gauss(0, 8 if t != "co2" else 120), 2)
                    if t == "humidity" and ts_utc.month == 3:
                        val = round(val + (6 if b == "B" else 0), 2)
                    flag = "bad" if rng.random() < 0.08 else None
                    if flag:
                        val = round(val + rng.choice([-40, 55]), 2)
                    readings.append({"ts": ts_utc.astimezone(tz).isoformat(), "value": val, "flag": flag})
                readings.sort(key=lambda r: r["ts"])
                sensors.append({"sensor_id": f"SN-{sid:03d}", "type": t,
                                "unit": {"humidity": "%RH", "temperature": "C", "co2": "ppm"}[t],
                                "readings": readings})
            sites.append({"site_id": f"{b}{k + 1}", "name": f"Building {b} floor {k + 1}",
                          "building": b, "sensors": sensors})

    def answer(use_utc: bool, drop_flagged: bool) -> float:
        vals = []
        for s in sites:
            if s["building"] != "B":
                continue
            for sn in s["sensors"]:
                if sn["type"] != "humidity":
                    continue
                for r in sn["readings"]:
                    ts = datetime.fromisoformat(r["ts"])
                    if use_utc:
                        ts = ts.astimezone(UTC)
                    if (ts.year, ts.month) != (2024, 3):
                        continue
                    if drop_flagged and r["flag"] is not None:
                        continue
                    vals.append(r["value"])
        return statistics.mean(vals)

    gold = answer(True, True)
    assert abs(gold - answer(False, True)) > 0.05  # local-time month boundary trap
    assert abs(gold - answer(True, False)) > 0.05  # flagged-readings trap
    doc = {"generated_at": "2024-04-20T00:00:00Z", "sites": sites}
    return dict(
        files={"sensors.json": json.dumps(doc, separators=(",", ":"))},
        gold=r2(gold), mode="numeric", atol="0.01", rtol="0",
        title="March humidity in building B",
        question="`/workdir/data/sensors.json` holds readings from sensors installed at several "
                 "sites. What is the mean `value` of all **humidity** readings from sites in "
                 "building `B` taken during **March 2024 in UTC**? Exclude readings that have a "
                 "non-null `flag`. Note that reading timestamps are recorded in each sensor's "
                 "local time with a UTC offset.",
        data_desc="- `sensors.json` — `{\"sites\": [{\"site_id\", \"name\", \"building\", "
                  "\"sensors\": [{\"sensor_id\", \"type\", \"unit\", \"readings\": [{\"ts\", "
                  "\"value\", \"flag\"}]}]}]}`; `ts` is an ISO-8601 timestamp with offset.",
        answer_format="Write the mean as a number rounded to 2 decimal places.",
        solve="""
import json
from datetime import datetime, timezone
doc = json.load(open("data/sensors.json"))
vals = []
for site in doc["sites"]:
    if site["building"] != "B":
        continue
    for sensor in site["sensors"]:
        if sensor["type"] != "humidity":
            continue
        for r in sensor["readings"]:
            ts = datetime.fromisoformat(r["ts"]).astimezone(timezone.utc)
            if ts.year == 2024 and ts.month == 3 and r.get("flag") is None:
                vals.append(r["value"])
open("answer.txt", "w").write(f"{sum(vals) / len(vals):.2f}\\n")
""",
        difficulty=5, category="data-analysis", tags=["json", "nested", "timezones", "mean"],
    )


def t_longest_session_user(rng: random.Random) -> dict:
    users = ["alice", "bruno", "chen", "dana", "emeka", "farah", "goran", "hiro"]
    events = []
    truth = defaultdict(float)
    nsess = Counter()
    for u in users:
        t = datetime(2024, 4, 1, 6, 0, tzinfo=UTC) + timedelta(minutes=rng.randint(0, 600))
        k = rng.randint(8, 20)
        for _ in range(k):
            t += timedelta(minutes=rng.randint(60, 2400))
            dur = rng.randint(5, 190)
            events.append({"ts": t, "user": u, "event": "login"})
            for _ in range(rng.randint(0, 4)):
                events.append({"ts": t + timedelta(minutes=rng.randint(1, max(1, dur - 1))),
                               "user": u, "event": rng.choice(["click", "view", "heartbeat"])})
            if rng.random() < 0.08:
                # abandoned session: no logout (the next login starts a new session)
                continue
            events.append({"ts": t + timedelta(minutes=dur), "user": u, "event": "logout"})
            truth[u] += dur
            nsess[u] += 1
            t += timedelta(minutes=dur)
    # one user leaves many sessions open: lots of logins, little logged time
    t = datetime(2024, 4, 2, 7, 0, tzinfo=UTC)
    for _ in range(40):
        t += timedelta(minutes=rng.randint(200, 900))
        events.append({"ts": t, "user": "ines", "event": "login"})
    events.append({"ts": t + timedelta(minutes=30), "user": "ines", "event": "logout"})
    truth["ines"] += 30
    rng.shuffle(events)
    ranked = sorted(truth.items(), key=lambda kv: -kv[1])
    gold = ranked[0][0]
    assert ranked[0][1] - ranked[1][1] > 20
    assert Counter(e["user"] for e in events if e["event"] == "login").most_common(1)[0][0] != gold
    lines = [json.dumps({"ts": e["ts"].strftime("%Y-%m-%dT%H:%M:%SZ"), "user": e["user"],
                         "event": e["event"]}) for e in events]
    return dict(
        files={"events.jsonl": "\n".join(lines) + "\n"},
        gold=gold, mode="exact_short", atol="0", rtol="0",
        title="User with the most logged-in time",
        question="`/workdir/data/events.jsonl` is an activity log (one JSON object per line, **not** "
                 "in chronological order). A session starts at a user's `login` event and ends at "
                 "that user's next `logout` event. A `login` that is followed by another `login` "
                 "of the same user before any `logout` is an abandoned session and contributes no "
                 "time. Other event types (`click`, `view`, `heartbeat`) do not affect sessions. "
                 "Which user has the largest total session time?",
        data_desc="- `events.jsonl` — JSON lines with keys `ts` (ISO-8601, UTC), `user`, `event`.",
        answer_format="Write the user name exactly as it appears in the file.",
        solve="""
import json
from collections import defaultdict
from datetime import datetime
events = [json.loads(line) for line in open("data/events.jsonl") if line.strip()]
events.sort(key=lambda e: datetime.fromisoformat(e["ts"].replace("Z", "+00:00")))
open_at, total = {}, defaultdict(float)
for e in events:
    ts = datetime.fromisoformat(e["ts"].replace("Z", "+00:00"))
    if e["event"] == "login":
        open_at[e["user"]] = ts
    elif e["event"] == "logout" and e["user"] in open_at:
        total[e["user"]] += (ts - open_at.pop(e["user"])).total_seconds()
open("answer.txt", "w").write(max(total, key=total.get) + "\\n")
""",
        difficulty=5, category="log-analysis", tags=["jsonl", "sessions", "dates", "sorting"],
        reward_json=True,
    )


BUILDERS = [
    ("orders_count", t_orders_count),
    ("priciest_product", t_priciest_product),
    ("http_500_count", t_http_500_count),
    ("west_completed_revenue", t_west_completed_revenue),
    ("scifi_avg_rating", t_scifi_avg_rating),
    ("low_stock_value", t_low_stock_value),
    ("top_category_revenue", t_top_category_revenue),
    ("highest_median_salary", t_highest_median_salary),
    ("station_member_duration", t_station_member_duration),
    ("country_top_spend", t_country_top_spend),
    ("supplier_profit", t_supplier_profit),
    ("cohort_stats_average", t_cohort_stats_average),
    ("late_invoices", t_late_invoices),
    ("building_b_humidity", t_building_b_humidity),
    ("longest_session_user", t_longest_session_user),
]


def toml_str(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)  # a JSON string literal is a valid TOML basic string


def render_task_toml(task_id: str, spec: dict) -> str:
    tags = ", ".join(toml_str(t) for t in spec["tags"])
    lines = [
        'version = "1.0"',
        "",
        "[metadata]",
        f"task_id = {toml_str(task_id)}",
        f"title = {toml_str(spec['title'])}",
        f"gold_answer = {toml_str(spec['gold'])}",
        f"reward_mode_initial = {toml_str(spec['mode'])}",
        f"difficulty_level = {spec['difficulty']}",
        f"category = {toml_str(spec['category'])}",
        f"tags = [{tags}]",
        f"reward_file = {toml_str('reward.json' if spec.get('reward_json') else 'reward.txt')}",
        'author_name = "trl-harbor"',
        "",
        "[verifier]",
        "timeout_sec = 60.0",
        "",
        "[verifier.env]",
        f"EXPECTED_ANSWER = {toml_str(spec['gold'])}",
        f"REWARD_MODE = {toml_str(spec['mode'])}",
        f"ATOL = {toml_str(spec['atol'])}",
        f"RTOL = {toml_str(spec['rtol'])}",
        "",
        "[agent]",
        "timeout_sec = 600.0",
        "",
        "[environment]",
        "build_timeout_sec = 600.0",
        "cpus = 1",
        "memory_mb = 1024",
        "storage_mb = 2048",
    ]
    net = spec.get("network", "no-network")
    if net is not None:
        lines.append(f"network_mode = {toml_str(net)}")
    return "\n".join(lines) + "\n"


def render_instruction(spec: dict) -> str:
    return (
        f"# {spec['title']}\n\n"
        f"{spec['question']}\n\n"
        "## Data\n\n"
        "The data files are in `/workdir/data/`:\n\n"
        f"{spec['data_desc']}\n\n"
        "## Answer\n\n"
        "Write **only** the final answer to `/workdir/answer.txt` — a single line with no "
        f"explanation, labels or units. {spec['answer_format']}\n"
    )


def _apt_install(packages) -> list[str]:
    return [
        "RUN apt-get update \\",
        f" && apt-get install -y --no-install-recommends {' '.join(packages)} \\",
        " && rm -rf /var/lib/apt/lists/*",
    ]


def render_dockerfile(spec: dict) -> str:
    # debian:bookworm-slim rather than python:3.x-slim: an offline machine that reaches a Debian
    # mirror but no registry can still build it (the local backend bootstraps the base with
    # mmdebstrap), and Docker pulls it as usual. The first RUN is the same in every task, so a
    # builder's layer cache builds it once for the whole suite.
    lines = ["FROM debian:bookworm-slim", "", *_apt_install(["python3"])]
    if spec.get("apt"):
        lines += _apt_install(spec["apt"])
    lines += [
        "",
        "ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1",
        "",
        "WORKDIR /workdir",
        "COPY data/ /workdir/data/",
    ]
    return "\n".join(lines) + "\n"


def render_solve(spec: dict) -> str:
    return (
        "#!/bin/bash\n"
        "# Reference solution (oracle): recomputes the answer from the data files.\n"
        "set -euo pipefail\n"
        "cd /workdir\n"
        "python3 - <<'PY'\n"
        f"{spec['solve'].strip()}\n"
        "PY\n"
        'echo "answer: $(cat /workdir/answer.txt)"\n'
    )


def render_test_sh(spec: dict) -> str:
    if spec.get("reward_json"):
        args = "--json"
        fallback = ('echo \'{"reward": 0.0, "exact": 0.0, "numeric_close": 0.0, '
                    '"answered": 0.0}\' > /logs/verifier/reward.json')
    else:
        args = ""
        fallback = "echo 0 > /logs/verifier/reward.txt"
    return TEST_SH_TMPL.replace(" __GRADE_ARGS__", f" {args}" if args else "").replace(
        "__FALLBACK__", fallback)


def main() -> None:
    TASKS_DIR.mkdir(parents=True, exist_ok=True)
    summary = []
    for idx, (task_id, builder) in enumerate(BUILDERS):
        rng = random.Random(f"{SEED}:{task_id}")
        spec = builder(rng)
        tdir = TASKS_DIR / task_id
        if tdir.exists():
            shutil.rmtree(tdir)
        (tdir / "environment" / "data").mkdir(parents=True)
        (tdir / "solution").mkdir()
        (tdir / "tests").mkdir()
        for rel, text in spec["files"].items():
            (tdir / "environment" / "data" / rel).write_text(text)
        (tdir / "environment" / "Dockerfile").write_text(render_dockerfile(spec))
        (tdir / "instruction.md").write_text(render_instruction(spec))
        (tdir / "task.toml").write_text(render_task_toml(task_id, spec))
        solve = tdir / "solution" / "solve.sh"
        solve.write_text(render_solve(spec))
        test = tdir / "tests" / "test.sh"
        test.write_text(render_test_sh(spec))
        (tdir / "tests" / "grade.py").write_text(GRADER)
        for p in (solve, test, tdir / "tests" / "grade.py"):
            p.chmod(0o755)
        size = sum(len(t) for t in spec["files"].values())
        summary.append((task_id, spec["difficulty"], spec["mode"], spec["gold"], size))
    for row in summary:
        print("%-26s L%d %-12s %-22s %6d B" % row)


if __name__ == "__main__":
    main()
