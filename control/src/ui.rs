//! The operator web UI (`web-ui/`), built by Vite into `web-ui/dist/` and
//! embedded in the binary: `GET /ui/` serves the page, `GET /ui/assets/*` its
//! script and style sheet, `GET /ui/favicon.svg` (and `/favicon.ico`) its icon.
//! No Node is needed at run time.
//!
//! Every answer carries a strict Content-Security-Policy: scripts, styles and
//! API calls from this origin only, no inline script or style element, no
//! frames, no external fonts or images. The page is a client of the public
//! API; it holds the bearer token in session storage and sends it in the
//! `Authorization` header, never in a URL.
use axum::extract::Path;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use axum::routing::get;
use axum::Router;

/// The Content-Security-Policy of every `/ui/` answer.
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; \
     img-src 'self' data:; connect-src 'self'; font-src 'none'; object-src 'none'; \
     base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// The embedded files: path under `/ui/`, content type, bytes.
const FILES: &[(&str, &str, &[u8])] = &[
    (
        "index.html",
        "text/html; charset=utf-8",
        include_bytes!("../../web-ui/dist/index.html"),
    ),
    (
        "assets/app.js",
        "text/javascript; charset=utf-8",
        include_bytes!("../../web-ui/dist/assets/app.js"),
    ),
    (
        "assets/app.css",
        "text/css; charset=utf-8",
        include_bytes!("../../web-ui/dist/assets/app.css"),
    ),
    (
        "favicon.svg",
        "image/svg+xml",
        include_bytes!("../../web-ui/dist/favicon.svg"),
    ),
    (
        "favicon.ico",
        "image/x-icon",
        include_bytes!("../../web-ui/dist/favicon.ico"),
    ),
];

/// Routes `/ui`, `/ui/`, `/ui/{*path}` and `/favicon.ico` (the console's icon,
/// which browsers also ask for at the root) (merge into a router with any
/// state).
pub fn router<S: Clone + Send + Sync + 'static>() -> Router<S> {
    Router::new()
        .route("/favicon.ico", get(|| async { file("favicon.ico") }))
        .route("/ui", get(|| async { Redirect::permanent("/ui/") }))
        .route("/ui/", get(|| async { file("index.html") }))
        .route(
            "/ui/{*path}",
            get(|Path(p): Path<String>| async move { file(&p) }),
        )
        // The request log names the route template, as for the API's routes.
        .route_layer(axum::middleware::from_fn(
            crate::serve::reqlog::record_route,
        ))
}

/// The embedded file at `path` (a path without a file extension is a screen of
/// the single-page app: the page itself), or a 404, with the security headers.
fn file(path: &str) -> Response {
    let found = FILES.iter().find(|(p, _, _)| *p == path).or_else(|| {
        let last = path.rsplit('/').next().unwrap_or(path);
        (!last.contains('.')).then_some(&FILES[0])
    });
    let mut r = match found {
        Some((_, mime, bytes)) => ([(header::CONTENT_TYPE, *mime)], *bytes).into_response(),
        None => (StatusCode::NOT_FOUND, "not found\n").into_response(),
    };
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(CSP),
    );
    h.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        HeaderValue::from_static("nosniff"),
    );
    h.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    h.insert(
        header::REFERRER_POLICY,
        HeaderValue::from_static("no-referrer"),
    );
    // Names are fixed (not content-hashed): revalidate on every load.
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use http_body_util::BodyExt;
    use tower::ServiceExt;

    async fn get(path: &str) -> (StatusCode, axum::http::HeaderMap, String) {
        let app: Router = router();
        let r = app
            .oneshot(
                axum::http::Request::get(path)
                    .body(Body::empty())
                    .expect("request"),
            )
            .await
            .expect("answer");
        let (parts, body) = r.into_parts();
        let bytes = body.collect().await.expect("body").to_bytes();
        (
            parts.status,
            parts.headers,
            String::from_utf8_lossy(&bytes).into_owned(),
        )
    }

    #[tokio::test]
    async fn page_and_assets_are_served_with_the_csp_and_nothing_else_is() {
        let (st, h, body) = get("/ui/").await;
        assert_eq!(st, StatusCode::OK);
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
        assert!(h[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/html"));
        // The page loads exactly the embedded script and style sheet, and has no
        // inline script (the CSP would block it).
        assert!(body.contains("src=\"/ui/assets/app.js\""), "{body}");
        assert!(body.contains("href=\"/ui/assets/app.css\""), "{body}");
        assert_eq!(body.matches("<script").count(), 1, "{body}");
        assert!(
            !body.contains("http://") && !body.contains("https://"),
            "{body}"
        );
        let (st, h, js) = get("/ui/assets/app.js").await;
        assert_eq!(st, StatusCode::OK);
        assert!(h[header::CONTENT_TYPE]
            .to_str()
            .unwrap()
            .starts_with("text/javascript"));
        assert!(js.len() > 1000);
        let (st, _, _) = get("/ui/assets/app.css").await;
        assert_eq!(st, StatusCode::OK);
        // A screen path is the page; an unknown file is a 404 with the CSP.
        let (st, _, b) = get("/ui/policies").await;
        assert_eq!((st, b.contains("app.js")), (StatusCode::OK, true));
        let (st, h, _) = get("/ui/assets/nope.js").await;
        assert_eq!(st, StatusCode::NOT_FOUND);
        assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
        // The icon, at the root and under /ui/, with the CSP (img-src 'self').
        for (path, mime) in [
            ("/favicon.ico", "image/x-icon"),
            ("/ui/favicon.ico", "image/x-icon"),
            ("/ui/favicon.svg", "image/svg+xml"),
        ] {
            let (st, h, body) = get(path).await;
            assert_eq!(st, StatusCode::OK, "{path}");
            assert_eq!(h[header::CONTENT_TYPE], mime, "{path}");
            assert_eq!(h[header::CONTENT_SECURITY_POLICY], CSP);
            assert!(!body.is_empty());
        }
        assert!(CSP.contains("img-src 'self'"));
        let (st, h, _) = get("/ui").await;
        assert_eq!(st, StatusCode::PERMANENT_REDIRECT);
        assert_eq!(h[header::LOCATION], "/ui/");
    }
}
