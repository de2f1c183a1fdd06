//! Query strings, and the label and field selectors of lists and watches.

use std::collections::HashMap;

use crate::{
    api::slice_labels,
    store::{Event, EventKind, StoredSlice},
};

pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        let escaped = (byte == b'%')
            .then(|| bytes.get(index + 1..index + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok());
        match (byte, escaped) {
            (_, Some(value)) => {
                decoded.push(value);
                index += 3;
            }
            (b'+', None) => {
                decoded.push(b' ');
                index += 1;
            }
            (other, None) => {
                decoded.push(other);
                index += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

pub fn parse_query(query: Option<&str>) -> HashMap<String, String> {
    query
        .unwrap_or_default()
        .split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(key), percent_decode(value))
        })
        .collect()
}

/// Go's strconv.ParseBool, which the apiserver uses for flags.
pub fn parse_bool(name: &str, text: Option<&String>) -> Result<bool, String> {
    match text.map(String::as_str) {
        None | Some("") => Ok(false),
        Some("1" | "t" | "T" | "true" | "TRUE" | "True") => Ok(true),
        Some("0" | "f" | "F" | "false" | "FALSE" | "False") => Ok(false),
        Some(other) => Err(format!("invalid value for {name}: {other:?}")),
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    Equals(String, String),
    NotEquals(String, String),
    Exists(String),
    NotExists(String),
}

impl Requirement {
    fn holds(&self, value_of: impl Fn(&str) -> Option<String>) -> bool {
        match self {
            Requirement::Equals(key, value) => value_of(key).as_deref() == Some(value.as_str()),
            Requirement::NotEquals(key, value) => value_of(key).as_deref() != Some(value.as_str()),
            Requirement::Exists(key) => value_of(key).is_some(),
            Requirement::NotExists(key) => value_of(key).is_none(),
        }
    }
}

/// `key=value`, `key==value`, `key!=value`, `key` and `!key` terms joined
/// by commas. Set-based terms (`in`, `notin`) are refused, not ignored.
pub fn parse_selector(text: &str) -> Result<Vec<Requirement>, String> {
    if text.contains('(') {
        return Err(format!(
            "unsupported selector {text:?}: only equality terms"
        ));
    }
    let valid_key = |key: &str| !key.is_empty() && !key.contains(char::is_whitespace);
    let mut requirements = Vec::new();
    for term in text
        .split(',')
        .map(str::trim)
        .filter(|term| !term.is_empty())
    {
        let requirement = if let Some((key, value)) = term.split_once("!=") {
            Requirement::NotEquals(key.trim().to_string(), value.trim().to_string())
        } else if let Some((key, value)) = term.split_once("==").or_else(|| term.split_once('=')) {
            Requirement::Equals(key.trim().to_string(), value.trim().to_string())
        } else if let Some(key) = term.strip_prefix('!') {
            Requirement::NotExists(key.trim().to_string())
        } else {
            Requirement::Exists(term.to_string())
        };
        let key = match &requirement {
            Requirement::Equals(key, _)
            | Requirement::NotEquals(key, _)
            | Requirement::Exists(key)
            | Requirement::NotExists(key) => key,
        };
        if !valid_key(key) {
            return Err(format!("invalid selector term {term:?}"));
        }
        requirements.push(requirement);
    }
    Ok(requirements)
}

/// Which slices a list or a watch is about.
#[derive(Debug, Clone)]
pub struct Selector {
    namespace: Option<String>,
    labels: Vec<Requirement>,
    fields: Vec<Requirement>,
}

impl Selector {
    pub fn parse(namespace: Option<&str>, query: &HashMap<String, String>) -> Result<Self, String> {
        let labels = parse_selector(query.get("labelSelector").map_or("", String::as_str))?;
        let fields = parse_selector(query.get("fieldSelector").map_or("", String::as_str))?;
        for field in &fields {
            match field {
                Requirement::Equals(key, _) | Requirement::NotEquals(key, _)
                    if key == "metadata.name" || key == "metadata.namespace" => {}
                _ => {
                    return Err(format!(
                        "field label not supported: {field:?} (metadata.name and metadata.namespace are)"
                    ));
                }
            }
        }
        Ok(Self {
            namespace: namespace.map(ToString::to_string),
            labels,
            fields,
        })
    }

    pub fn matches(&self, slice: &StoredSlice) -> bool {
        if self
            .namespace
            .as_ref()
            .is_some_and(|namespace| *namespace != slice.namespace)
        {
            return false;
        }
        let labels = slice_labels(&slice.spec);
        let field = |key: &str| match key {
            "metadata.name" => Some(slice.name.clone()),
            "metadata.namespace" => Some(slice.namespace.clone()),
            _ => None,
        };
        self.labels
            .iter()
            .all(|requirement| requirement.holds(|key| labels.get(key).cloned()))
            && self
                .fields
                .iter()
                .all(|requirement| requirement.holds(field))
    }

    /// What a watch with this selector sees of an event, if anything: a
    /// slice that starts or stops matching is ADDED or DELETED for it, as
    /// the apiserver's watch cache does.
    pub fn view(&self, event: &Event) -> Option<EventKind> {
        let now = self.matches(&event.object);
        match event.kind {
            EventKind::Added | EventKind::Deleted => now.then_some(event.kind),
            EventKind::Modified => {
                let before = event
                    .previous
                    .as_ref()
                    .is_some_and(|previous| self.matches(previous));
                match (before, now) {
                    (true, true) => Some(EventKind::Modified),
                    (false, true) => Some(EventKind::Added),
                    (true, false) => Some(EventKind::Deleted),
                    (false, false) => None,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use socklb_tests::kube::SERVICE_NAME_LABEL;

    use super::*;

    #[test]
    fn selectors_read_equality_terms_and_refuse_set_based_ones() {
        assert_eq!(
            parse_selector("kubernetes.io/service-name=kubernetes, a!=b,c==d,e,!f").unwrap(),
            vec![
                Requirement::Equals(SERVICE_NAME_LABEL.into(), "kubernetes".into()),
                Requirement::NotEquals("a".into(), "b".into()),
                Requirement::Equals("c".into(), "d".into()),
                Requirement::Exists("e".into()),
                Requirement::NotExists("f".into()),
            ]
        );
        assert!(parse_selector("a in (b,c)").is_err());
        assert!(parse_selector("=b").is_err());
        assert_eq!(
            percent_decode("kubernetes.io%2Fservice-name%3Dkubernetes+x"),
            "kubernetes.io/service-name=kubernetes x"
        );
    }
}
